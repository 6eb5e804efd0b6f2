#!/usr/bin/env bash
# 02_mesh_domains on 4 ranks: a 2 x 2 (dp_replicate x tp) mesh, then a tp of 3 that cannot fit.
set -uo pipefail
d9drun=$1
example=$2
out=$("$d9drun" -n 4 "$example" --dp-replicate 2 --tp 2 --ep 2 2>&1)
status=$?
echo "$out"
[ $status -eq 0 ] || { echo "FAIL: the example exited with $status"; exit 1; }
for want in "every group checked" "expert: pp=0/1{" "batch: pp=0/1{" \
            "[rank 3] [d9d rank 3/4 | dp_replicate=1 tp=1] regular: pp=0/1{3} dp_replicate=1/2{1,3}"; do
  grep -qF -- "$want" <<<"$out" || { echo "FAIL: output lacks '$want'"; exit 1; }
done
bad=$("$d9drun" -n 4 "$example" --tp 3 2>&1)
status=$?
echo "$bad"
[ $status -eq 2 ] || { echo "FAIL: a tp of 3 on 4 ranks exited with $status, not 2"; exit 1; }
for rank in 0 1 2 3; do
  grep -qF -- "[rank $rank] [d9d rank $rank/4] error: d9d::mesh: cannot infer dp_shard" <<<"$bad" ||
    { echo "FAIL: rank $rank did not report the mesh error"; exit 1; }
done
echo "ok"
