#!/usr/bin/env bash
# Apply patches/pretrain_gpt_zeppelin.patch to a Megatron-LM checkout.
#
#   scripts/apply_patch.sh MEGATRON_DIR
#
# The patch applies to pretrain_gpt.py of Megatron-LM core_v0.16.1 and of the 0.19 releases
# (core_v0.19.0, the core_r0.19.0 branch). With --zeppelin on the command line the script hands
# the run to megatron_zeppelin's entry point (megatron_zeppelin/pretrain_gpt.py), which passes
# the release's pretrain() Zeppelin's hooks; without the flag the script behaves exactly as
# upstream. Applying twice is a no-op (the second run is detected and skipped).
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 MEGATRON_DIR" >&2
    exit 2
fi
megatron_dir=$1
patch_file="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/patches/pretrain_gpt_zeppelin.patch"

if [[ ! -f "$megatron_dir/pretrain_gpt.py" ]]; then
    echo "error: $megatron_dir/pretrain_gpt.py not found: pass the root of a Megatron-LM checkout" >&2
    exit 2
fi
# Already applied: the reverse patch applies cleanly.
if patch --dry-run --reverse --force -p1 -d "$megatron_dir" < "$patch_file" > /dev/null 2>&1; then
    echo "pretrain_gpt.py in $megatron_dir is already patched"
    exit 0
fi
if ! patch --dry-run --forward -p1 -d "$megatron_dir" < "$patch_file" > /dev/null; then
    echo "error: the patch does not apply to $megatron_dir/pretrain_gpt.py;" \
        "check out a supported release (git -C $megatron_dir checkout core_v0.16.1, or" \
        "core_r0.19.0)" >&2
    exit 1
fi
patch --forward -p1 -d "$megatron_dir" < "$patch_file"
echo "patched $megatron_dir/pretrain_gpt.py: run it with --zeppelin to use megatron_zeppelin"
