#!/usr/bin/env bash
# PBKV inside a real SGLang server: LRU against PBKV on 50 hover workflows (docs/serving.md).
#
# Needs: one NVIDIA GPU (any with >= 16 GB), Python 3.11 with the FULL sglang 0.5.23 install
# (`pip install "sglang==0.5.23"`, which brings its CUDA torch) and this repository installed into
# the same environment (docs/serving.md section 2: `pip install --no-deps -e .` plus requirements.txt
# without its torch pin), so that the
# `sglang.srt.plugins` entry point exists. Nothing is downloaded: the model is a small Llama-shaped
# config with random weights (--load-format dummy, --skip-tokenizer-init; the bench sends token ids).
# Takes about 5-10 minutes: two server starts and two replays of ~400 calls.
#
#   bash scripts/gpu_smoke.sh                 # prints the lru and pbkv rows, writes runs/gpu_smoke/
#   RUN=/tmp/smoke GPU_TOKENS=32000 CONCURRENCY=8 bash scripts/gpu_smoke.sh
#   POLICIES="lru pbkv pbkv+partial" HIDDEN=0 bash scripts/gpu_smoke.sh   # also pbkv with partial eviction
#
# A policy named NAME+partial runs NAME with the plugin's partial_eviction (victims split to the pages
# still needed, docs/serving.md section 13) and reports its partial_evictions counters.
#
# Then (HIDDEN=1, the default; HIDDEN=0 skips it) the serving model's hidden state, steps 5-7: collect
# traces with each call's hidden state (pbkv_lae --hidden-state, bench --save-trace), compare the
# text signals on them (train.py train_experiment=signals), and serve a graphsage trained on the
# hidden states under pbkv --hidden-state. HIDDEN_MODEL=Qwen/Qwen3-8B (any HF model or local
# directory; downloaded by SGLang unless cached) runs these steps on a real model, whose hidden
# states carry what the model understood of the prompt; the default is the random-weight model
# above, whose hidden state carries only what a random network extracts. HIDDEN_DIM (default 384)
# is the predictor's input size the hidden states are projected to.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
RUN=${RUN:-runs/gpu_smoke}
PORT=${PORT:-30000}
N_WORKFLOWS=${N_WORKFLOWS:-50}
CONCURRENCY=${CONCURRENCY:-8}
GPU_TOKENS=${GPU_TOKENS:-48000}     # small on purpose: LRU must run out of GPU cache for policies to differ
TOOL_TIME_SCALE=${TOOL_TIME_SCALE:-1.0}
POLICIES=${POLICIES:-"lru pbkv"}
HIDDEN=${HIDDEN:-1}
HIDDEN_MODEL=${HIDDEN_MODEL:-}
HIDDEN_DIM=${HIDDEN_DIM:-384}
N_COLLECT=${N_COLLECT:-200}
export WANDB_MODE=offline HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The plugin's policies always run on SGLang's Python tree core; give lru the same core so that the
# latency columns compare policies, not tree-core implementations.
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=${SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND:-python}

mkdir -p "$RUN/model"
"$PY" - <<'EOF' || { echo "error: the PBKV plugin is not installed (pip install --no-deps -e .)"; exit 1; }
from importlib.metadata import entry_points
assert any(ep.name == "pbkv" for ep in entry_points(group="sglang.srt.plugins"))
import sglang, torch
assert torch.cuda.is_available(), "no CUDA device"
print(f"sglang {sglang.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
EOF

echo "== 1/7 a small model config (random weights, nothing downloaded): $RUN/model"
cat > "$RUN/model/config.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
 "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
 "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000, "max_position_embeddings": 32768,
 "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
 "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2}
EOF

echo "== 2/7 traces: $N_WORKFLOWS hover workflows to replay, 300 others to fit the predictor on"
"$PY" -m data.generate workload=hover n_workflows="$N_WORKFLOWS" seed=0 out="$RUN/data" overwrite=true
"$PY" -m data.generate workload=hover n_workflows=300 seed=1 out="$RUN/train_data" overwrite=true

echo "== 3/7 a Markov predictor checkpoint: $RUN/train/predictor.pt"
if ! "$PY" train.py model=markov data.path="$RUN/train_data" logger=csv trainer.max_epochs=1 \
      hydra.run.dir="$RUN/train" >"$RUN/train.log" 2>&1; then
  echo "   train.py failed (see $RUN/train.log); fitting the Markov counts directly"
  "$PY" - "$RUN/train_data" "$RUN/train/predictor.pt" <<'EOF'
import sys
from data import store
from models import save_predictor
from models.markov import MarkovPredictor
from serving_integration.cache.predictions import vocabulary
from serving_integration.simulator.engine import workflows_from_rows
sequences = [[c.agent for c in w.calls] for w in workflows_from_rows(store.load(sys.argv[1]).rows("train"))]
names = vocabulary(a for s in sequences for a in s)
index = {a: i for i, a in enumerate(names)}
save_predictor(MarkovPredictor.from_sequences(names, 3, [[index[a] for a in s] for s in sequences], order=1), sys.argv[2])
EOF
fi

echo "== 4/7 replay under each policy: $POLICIES (concurrency $CONCURRENCY, $GPU_TOKENS GPU tokens, host 2x)"
rm -f "$RUN/bench/summary.json"
SERVER_PID=""
stop_server() { if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; SERVER_PID=""; fi; }
trap stop_server EXIT
wait_healthy() {  # $1: a name for the messages, $2: its log
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server ($1) died, see $2"; tail -20 "$2"; exit 1; }
    sleep 2
  done
  echo "server ($1) not ready after 10 min"; exit 1
}
for label in $POLICIES; do
  policy=${label%+partial}
  extra=()
  [ "$label" != "$policy" ] && extra=(--policy-config '{"partial_eviction": true}')
  [ "$policy" = pbkv ] && extra+=(--checkpoint "$RUN/train/predictor.pt")
  [ "$policy" = kvflow ] && extra+=(--step-graph-traces "$RUN/train_data")
  "$PY" -m serving_integration.server.launch --model-path "$RUN/model" --policy "$policy" --port "$PORT" \
      --stats-path "$RUN/stats_$label.json" "${extra[@]}" -- \
      --load-format dummy --skip-tokenizer-init --max-total-tokens "$GPU_TOKENS" --context-length 32768 \
      --mem-fraction-static 0.6 --cuda-graph-max-bs "$CONCURRENCY" --log-level warning \
      >"$RUN/server_$label.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "$label" "$RUN/server_$label.log"
  "$PY" -m serving_integration.experiments.bench --url "http://127.0.0.1:$PORT" --data "$RUN/data" --split all \
      --concurrency "$CONCURRENCY" --tool-time-scale "$TOOL_TIME_SCALE" --token-range 1000 30000 \
      --policy "$label" --out "$RUN/bench" --append
  stop_server
done

echo "== rows ($RUN/bench/summary.json)"
"$PY" - "$RUN/bench/summary.json" <<'EOF'
import json, sys
from serving_integration.experiments.evaluation import format_table
rows = json.load(open(sys.argv[1]))["rows"]
print(format_table(rows))
for r in rows:
    c = r.get("plugin_counters") or {}
    if c:
        keys = ("calls_finished", "predictor_calls", "fallback_rounds", "metadata_missing", "metadata_bad",
                "hook_errors", "prefetch_rounds", "prefetched_tokens", "prefetch_used_tokens", "partial_evictions",
                "partial_eviction_kept_tokens")
        print(f"{r['policy']} plugin: " + ", ".join(f"{k}={c.get(k, 0)}" for k in keys)
              + f", prefetch_precision={r.get('prefetch_precision')}")
EOF

[ "$HIDDEN" = 1 ] || exit 0
# the hidden-state steps: the random-weight model of step 1 unless HIDDEN_MODEL names a real one
if [ -n "$HIDDEN_MODEL" ]; then model=(--model-path "$HIDDEN_MODEL"); load=(); else
  model=(--model-path "$RUN/model"); load=(--load-format dummy --skip-tokenizer-init); fi
serve_hidden() {  # $1: name, then launch's options
  local name=$1; shift
  "$PY" -m serving_integration.server.launch "${model[@]}" --port "$PORT" --hidden-state \
      --stats-path "$RUN/stats_$name.json" "$@" -- "${load[@]}" --max-total-tokens "$GPU_TOKENS" \
      --context-length 32768 --mem-fraction-static 0.6 --cuda-graph-max-bs "$CONCURRENCY" --log-level warning \
      >"$RUN/server_$name.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "$name" "$RUN/server_$name.log"
}

echo "== 5/7 collect $N_COLLECT workflows with each call's hidden state: $RUN/collected"
"$PY" -m data.generate workload=hover n_workflows="$N_COLLECT" seed=2 out="$RUN/collect_data" overwrite=true
serve_hidden collect --policy pbkv_lae
"$PY" -m serving_integration.experiments.bench --url "http://127.0.0.1:$PORT" --data "$RUN/collect_data" \
    --split all --concurrency "$CONCURRENCY" --tool-time-scale 0 --out "$RUN/bench_collect" \
    --save-trace "$RUN/collected" --no-progress
stop_server

echo "== 6/7 text signals on the collected traces (graphsage: hidden / encoder / none, markov; 5 splits)"
"$PY" train.py train_experiment=signals data=collected data.source.src="$RUN/collected/calls.native.jsonl" \
    datamodule.hidden_dim="$HIDDEN_DIM" data.cache_dir="$RUN/data_cache" hydra.sweep.dir="$RUN/signals" \
    logger=csv >"$RUN/signals.log" 2>&1 || { echo "train.py failed, see $RUN/signals.log"; exit 1; }
"$PY" -m benchmarks.predictor_table "$RUN/signals" --by text --interval --metric top1
"$PY" train.py model=graphsage data.path="$RUN/collected/dataset" datamodule.text_source=hidden \
    datamodule.hidden_dim="$HIDDEN_DIM" logger=csv hydra.run.dir="$RUN/train_hidden" >"$RUN/train_hidden.log" 2>&1

echo "== 7/7 pbkv serving the hidden-state checkpoint ($RUN/train_hidden/predictor.pt)"
serve_hidden pbkv_hidden --policy pbkv --checkpoint "$RUN/train_hidden/predictor.pt"
"$PY" -m serving_integration.experiments.bench --url "http://127.0.0.1:$PORT" --data "$RUN/data" --split all \
    --concurrency "$CONCURRENCY" --tool-time-scale "$TOOL_TIME_SCALE" --policy pbkv --out "$RUN/bench_hidden" \
    --no-progress
stop_server
