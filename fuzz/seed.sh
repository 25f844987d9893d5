#!/usr/bin/env bash
# Seeds each fuzz corpus with valid files, so the fuzzer starts past the magic checks.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p fuzz/corpus/snapshot_parse fuzz/corpus/gguf_parse fuzz/corpus/packed_index
cp snapshot/tests/fixtures/*.gguf fuzz/corpus/gguf_parse/
cargo run -q -- snapshot synth --preset tiny --dtype f16 -o fuzz/corpus/snapshot_parse/tiny.preheat
cargo run -q -- snapshot pack fuzz/corpus/snapshot_parse/tiny.preheat --chunk-mib 1 -o fuzz/corpus/packed_index/tiny.phpack
