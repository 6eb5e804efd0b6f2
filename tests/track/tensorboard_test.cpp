// TensorBoardWriter: byte-exact Event encoding, the file it writes, its errors, and a read-back by
// TensorBoard itself (the `tensorboard` Python package of $D9D_PYTHON).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <regex>
#include <stdexcept>
#include <string>
#include <sys/wait.h>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/track/jsonl.hpp>
#include <d9d/track/tensorboard.hpp>

#include "tests/support/subprocess.hpp"
#include "tests/track/track_test_util.hpp"

namespace {

using ::testing::HasSubstr;
using track_test::from_hex;

TEST(Track_TensorBoard, EncodesScalarEventLikeProtobuf) {
  // Event {wall_time: 1.5, step: 3, summary {value {tag: "a", simple_value: 2}}}, as serialized
  // by the protobuf library from TensorBoard's event.proto.
  const std::array<std::pair<std::string_view, double>, 1> scalars{{{"a", 2.0}}};
  EXPECT_EQ(d9d::track::detail::encode_scalars_event(1.5, 3, scalars),
            from_hex("09 00 00 00 00 00 00 f8 3f  10 03  2a 0a  0a 08  0a 01 61  15 00 00 00 40"));
}

TEST(Track_TensorBoard, EncodesFileVersionEventAndNegativeSteps) {
  EXPECT_EQ(d9d::track::detail::encode_file_version_event(1.5),
            from_hex("09 00 00 00 00 00 00 f8 3f  1a 0d") + "brain.Event:2");
  // A negative int64 is a 10-byte varint (its two's complement as uint64).
  const track_test::Event event =
      track_test::decode_event(d9d::track::detail::encode_scalars_event(0.0, -1, {}));
  EXPECT_EQ(event.step, -1);
}

TEST(Track_TensorBoard, FloatConversionSaturatesBeyondFloatRange) {
  using d9d::track::detail::to_float_saturating;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(to_float_saturating(1e300), kInf);
  EXPECT_EQ(to_float_saturating(-1e300), -kInf);
  EXPECT_EQ(to_float_saturating(std::numeric_limits<double>::infinity()), kInf);
  EXPECT_TRUE(std::isnan(to_float_saturating(std::nan(""))));
  EXPECT_EQ(to_float_saturating(0.1), 0.1F);
  EXPECT_EQ(to_float_saturating(std::numeric_limits<float>::max()),
            std::numeric_limits<float>::max());
}

TEST(Track_TensorBoard, FileNamedLikeTensorBoardAndStartsWithVersionEvent) {
  const auto dir = track_test::scratch_dir("tb_file") + "/nested/run";
  std::string path;
  {
    d9d::track::TensorBoardWriter tb(dir, {.filename_suffix = "rank0"});
    path = tb.path();
    tb.add_scalar("train/loss", 2.5, 1, 100.0);
    tb.add_scalars(2, {{"train/loss", 2.0}, {"lr", 1e-3}}, 101.0);
  }
  EXPECT_EQ(track_test::dir_name(path), dir);
  EXPECT_TRUE(std::regex_match(track_test::base_name(path),
                               std::regex(R"(events\.out\.tfevents\.\d{10}\.[^.]+.*\.rank0)")))
      << path;

  const std::vector<track_test::Event> events = track_test::read_events(path);
  ASSERT_EQ(events.size(), 3U);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_TRUE(events[0].values.empty());
  EXPECT_EQ(events[1].wall_time, 100.0);
  EXPECT_EQ(events[1].step, 1);
  EXPECT_EQ(events[1].values, (std::vector<std::pair<std::string, float>>{{"train/loss", 2.5F}}));
  EXPECT_EQ(events[2].wall_time, 101.0);
  EXPECT_EQ(events[2].step, 2);
  EXPECT_EQ(events[2].values, (std::vector<std::pair<std::string, float>>{
                                  {"train/loss", 2.0F}, {"lr", static_cast<float>(1e-3)}}));
}

TEST(Track_TensorBoard, DefaultWallTimeIsNow) {
  const auto dir = track_test::scratch_dir("tb_wall_time");
  const double before = d9d::track::detail::unix_time_now();
  d9d::track::TensorBoardWriter tb(dir);
  tb.add_scalar("loss", 1.0, 7);
  tb.flush();
  const double after = d9d::track::detail::unix_time_now();
  for (const track_test::Event& event : track_test::read_events(tb.path())) {
    ASSERT_TRUE(event.wall_time.has_value());
    EXPECT_GE(*event.wall_time, before);
    EXPECT_LE(*event.wall_time, after);
  }
}

TEST(Track_TensorBoard, BuffersUntilFlushIntervalAndFlushesOnDestruction) {
  const auto dir = track_test::scratch_dir("tb_flush");
  std::string path;
  {
    d9d::track::TensorBoardWriter tb(dir, {.flush_interval_s = 1e9});
    path = tb.path();
    tb.add_scalar("loss", 1.0, 1);
    EXPECT_EQ(track_test::read_events(path).size(), 1U);  // only the version event so far
    tb.flush();
    EXPECT_EQ(track_test::read_events(path).size(), 2U);
    tb.add_scalar("loss", 0.5, 2);
  }
  EXPECT_EQ(track_test::read_events(path).size(), 3U);
}

TEST(Track_TensorBoard, TwoWritersInOneSecondGetTwoFiles) {
  const auto dir = track_test::scratch_dir("tb_two_writers");
  d9d::track::TensorBoardWriter first(dir);
  d9d::track::TensorBoardWriter second(dir);
  EXPECT_NE(first.path(), second.path());
  EXPECT_THAT(track_test::base_name(second.path()), HasSubstr("events.out.tfevents."));
}

TEST(Track_TensorBoard, UnwritableDirectoryThrowsNamingPath) {
  // A directory below a regular file cannot be created, by root neither.
  const auto blocker = track_test::scratch_dir("tb_unwritable") + "/not_a_dir";
  { std::ofstream(blocker) << "x"; }
  const auto dir = blocker + "/logs";
  try {
    d9d::track::TensorBoardWriter tb(dir);
    FAIL() << "expected std::runtime_error";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(),
                HasSubstr("d9d::track::TensorBoardWriter: cannot create directory '" + dir + "'"));
    EXPECT_THAT(e.what(), HasSubstr("Not a directory"));
  }
}

TEST(Track_TensorBoard, EmptyTagRejected) {
  d9d::track::TensorBoardWriter tb(track_test::scratch_dir("tb_empty_tag"));
  EXPECT_THROW(tb.add_scalar("", 1.0, 1), std::invalid_argument);
  EXPECT_THROW(tb.add_scalars(1, {{"ok", 1.0}, {"", 2.0}}), std::invalid_argument);
}

// ------------------------------------------------------------------------------------------------
// Read-back by TensorBoard: every TFRecord through TensorBoard's CRC-checking reader and Event
// proto, then every tag, step, value and wall time through its EventAccumulator. The expected
// values come from a JSON-lines file written next to the events (one line per add call).

constexpr const char* kReadBackScript = R"py(
import json, math, struct, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow

log_dir, event_file, expected_file = sys.argv[1:4]

def as_float32(x):
    if x is None:
        return math.nan
    if abs(x) > 3.4028234663852886e38:
        return math.copysign(math.inf, x)
    return struct.unpack("<f", struct.pack("<f", x))[0]

reader = pywrap_tensorflow.PyRecordReader_New(event_file)
events = []
while True:
    try:
        reader.GetNext()
    except errors.OutOfRangeError:
        break
    events.append(event_pb2.Event.FromString(reader.record()))
problems = []
if not events or events[0].file_version != "brain.Event:2":
    problems.append("first event is not the file version: %r" % (events[:1],))

expected = {}
for line in open(expected_file):
    row = json.loads(line)
    step, wall_time = row.pop("step"), row.pop("wall_time")
    for tag, value in row.items():
        expected.setdefault(tag, []).append((step, as_float32(value), wall_time))

accumulator = EventAccumulator(log_dir, size_guidance={"scalars": 0})
accumulator.Reload()
tags = sorted(accumulator.Tags()["scalars"])
if tags != sorted(expected):
    problems.append("tags %r != expected %r" % (tags, sorted(expected)))
count = 0
for tag, rows in sorted(expected.items()):
    got = [(e.step, e.value, e.wall_time) for e in accumulator.Scalars(tag)] if tag in tags else []
    if len(got) != len(rows):
        problems.append("%s: %d scalars, expected %d" % (tag, len(got), len(rows)))
    for want, have in zip(rows, got):
        same = want[1] == have[1] or (math.isnan(want[1]) and math.isnan(have[1]))
        if want[0] != have[0] or not same or want[2] != have[2]:
            problems.append("%s: got (step, value, wall_time) %r, expected %r" % (tag, have, want))
        count += 1
if problems:
    print("\n".join(problems))
    sys.exit(1)
print("tensorboard read %d records, checked %d scalars over %d tags" % (len(events), count, len(tags)))
)py";

TEST(Track_TensorBoard, ScalarsReadBackByTensorBoard) {
  const char* python = std::getenv("D9D_PYTHON");
  if (python == nullptr || *python == '\0') {
    FAIL() << "D9D_PYTHON is not set: this test needs a Python with the tensorboard package. "
              "tools/test passes it; with bazel, `source ~/.cache/d9d/env` and add "
              "--test_env=D9D_PYTHON=$D9D_PYTHON; with ctest, export D9D_PYTHON.";
  }
  const auto scratch = track_test::scratch_dir("tb_read_back");
  const auto log_dir = scratch + "/logs";
  std::string event_file;
  {
    d9d::track::TensorBoardWriter tb(log_dir, {.filename_suffix = "readback"});
    d9d::track::JsonlWriter expected(scratch + "/expected.jsonl");
    event_file = tb.path();
    const auto add = [&](std::string_view tag, double value, std::int64_t step, double wall) {
      tb.add_scalar(tag, value, step, wall);
      expected.write(step, {{std::string(tag), value}}, wall);
    };
    const double start = 1767225600.125;
    for (std::int64_t step = 0; step < 40; ++step) {
      const double wall = start + 0.25 * static_cast<double>(step);
      add("train/loss", 2.5 * std::exp(-0.05 * static_cast<double>(step)), step, wall);
      add("train/lr", 3e-4 * std::min(1.0, static_cast<double>(step + 1) / 10.0), step, wall);
      if (step % 10 == 9) {
        const std::vector<std::pair<std::string, double>> eval = {
            {"eval/loss", 2.0 / static_cast<double>(step)}, {"eval/accuracy_ü", 0.5 + 0.01 * step}};
        tb.add_scalars(step, eval, wall + 0.1);
        expected.write(step, eval, wall + 0.1);
      }
    }
    add("extremes", -1e-3, 1, start);
    add("extremes", 1e300, 2, start);  // beyond float: +inf
    add("extremes", std::nan(""), 3, start);
    add("extremes", 0.0, std::int64_t{1} << 40, start);  // a step needing a 6-byte varint
  }
  const std::string script_path = scratch + "/read_back.py";
  { std::ofstream(script_path) << kReadBackScript; }

  const std::string command =
      d9d::testing::shell_quote(python) + " " + d9d::testing::shell_quote(script_path) + " " +
      d9d::testing::shell_quote(log_dir) + " " + d9d::testing::shell_quote(event_file) + " " +
      d9d::testing::shell_quote(scratch + "/expected.jsonl") + " 2>&1";
  const auto run = d9d::testing::run_command(command);
  ASSERT_TRUE(WIFEXITED(run.status) && WEXITSTATUS(run.status) == 0)
      << command << "\nexited with status " << run.status << ":\n"
      << run.output;
  // 1 version event + 40 * 2 single scalars + 4 eval events + 4 extremes.
  EXPECT_THAT(run.output, HasSubstr("tensorboard read 89 records, checked 92 scalars over 5 tags"))
      << run.output;
}

}  // namespace
