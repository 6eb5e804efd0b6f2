#!/bin/sh
echo "d9d: bazel coverage is not supported offline (remote_coverage_tools is a stand-in)" >&2
exit 1
