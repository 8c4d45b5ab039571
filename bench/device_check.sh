#!/usr/bin/env bash
# The GPU check: the four rankers' training steps through the loop's DeepSpeed engine (fp32 vs bf16
# autocast, ZeRO-0 vs ZeRO-2; bench/train_step_device.py) and the QDS attention benchmark in fp32 and
# bf16 (bench/qds_attention.py), on a CUDA machine with PyTorch but no network.
#
#   bash bench/device_check.sh prepare [BUNDLE]   # here, with the project's .venv and PyPI: builds BUNDLE (.whl)
#   bash bench/device_check.sh run [BUNDLE] [OUT] # there, from the repository root, with BUNDLE copied along
#   bash bench/device_check.sh long [BUNDLE] [OUT] # there: QDS at 2,048 tokens, and 128 triples a step
#
# BUNDLE (about 52 MB) holds what such a machine lacks: wheels of DeepSpeed and its pure-Python needs,
# ir-measures (for CPython 3.12, x86-64), the offline MiniLM stored in bf16 (converted back to fp32
# there: the weights are then MiniLM's rounded to bf16) and a SciFact sample (training qrels, their
# judged documents and 600 others). Ray does not travel (its wheel alone is 79 MB): the check runs the
# engine and step functions that each Ray Train worker runs, in one process.
set -euo pipefail
cmd=${1:?prepare or run}
bundle=${2:-.whl}

if [[ $cmd == prepare ]]; then
    py=.venv/bin/python
    data=${DATA:-../shared/data/scifact}
    mkdir -p "$bundle/minilm" "$bundle/scifact/qrels"
    pip_args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
              --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    $py -m pip download -q "${pip_args[@]}" -d "$bundle" pydantic==2.14.4 pydantic_core==2.50.5 hjson==3.1.0 \
        annotated-types==0.8.0 typing-inspection==0.4.5 ir_measures==0.4.3 pytrec_eval_terrier==0.5.11
    $py -m pip wheel -q --no-deps "deepspeed==$($py -c 'from importlib.metadata import version; print(version("deepspeed"))')" -w "$bundle"
    $py - "$bundle" "$data" <<'EOF'
import json, random, shutil, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
from ckray.models.encoders import resolve_encoder
bundle, data = Path(sys.argv[1]), Path(sys.argv[2])
src = Path(resolve_encoder())
for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
    shutil.copy(src / f, bundle / "minilm" / f)
weights = load_file(str(src / "model.safetensors"))
save_file({k: v.bfloat16().contiguous() for k, v in weights.items()}, str(bundle / "minilm" / "bf16.safetensors"))
qrels = (data / "qrels" / "train.tsv").read_text().splitlines(keepends=True)
(bundle / "scifact" / "qrels" / "train.tsv").write_text("".join(qrels))
judged = {line.split("\t")[1] for line in qrels[1:]}
lines = (data / "corpus.jsonl").read_text().splitlines(keepends=True)
keep = [l for l in lines if json.loads(l)["_id"] in judged]
keep += random.Random(0).sample([l for l in lines if json.loads(l)["_id"] not in judged], 600)
(bundle / "scifact" / "corpus.jsonl").write_text("".join(keep))
shutil.copy(data / "queries.jsonl", bundle / "scifact" / "queries.jsonl")
EOF
    du -sh "$bundle"
    exit 0
fi

out=${3:-${OUT:-/tmp/device-check}}
mkdir -p "$out"
filter=(grep -v -e 'Loading weights' -e UNEXPECTED -e 'LOAD REPORT' -e '^Key ' -e '^---' -e '^Notes:' -e 'can be ignored')
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$bundle"/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
encoder=/tmp/minilm
mkdir -p $encoder && cp "$bundle"/minilm/*.json "$bundle"/minilm/vocab.txt $encoder/
python3 -c "
import sys; from safetensors.torch import load_file, save_file
save_file({k: v.float() for k, v in load_file(sys.argv[1]).items()}, sys.argv[2])" \
    "$bundle/minilm/bf16.safetensors" $encoder/model.safetensors
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'deepspeed', deepspeed.__version__)" 2>&1 | tail -1 | tee -a "$out/gpu.txt"
steps() { python3 bench/train_step_device.py --data "$bundle/scifact" --encoder $encoder "$@" 2> >("${filter[@]}" >&2); }
if [[ $cmd == long ]]; then   # the QDS kernels at the paper's 2,048 tokens, and every model at 128 triples a step
    steps --models qds-sparse,qds-fused-mask --qds-max-length 2048 --min-doc-words 1600 --batch-size 8 --steps 20 \
        | tee "$out/train_step_qds_2048.json"
    steps --models ck-qti,clear,cedr-knrm,qds-sparse,qds-fused-mask --batch-size 128 --steps 10 \
        | tee "$out/train_step_batch128.json"
    exit 0
fi
steps --batch-size ${BATCH:-32} --steps ${STEPS:-30} | tee "$out/train_step_device.json"
for dtype in float32 bfloat16; do
    python3 bench/qds_attention.py --device cuda --dtype $dtype --sizes 512,2048,8192 --repeats 5 \
        | tee "$out/qds_attention_$dtype.txt" | tail -1
done
