#!/usr/bin/env bash
# A Llama-3.1-8B-shaped model folder for vLLM's load_format="dummy" (random weights, real shapes and speed;
# the device has no hub). Usage: model-folder.sh DIR; env TOKENIZER_DIR copies its tokenizer files in.
set -euo pipefail
mkdir -p "$1"
cat > "$1/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 49152,
 "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "hidden_act": "silu",
 "tie_word_embeddings": false, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
JSON
if [ -n "${TOKENIZER_DIR:-}" ]; then
  cp "$TOKENIZER_DIR"/tokenizer* "$1"/ 2>/dev/null || true
  cp "$TOKENIZER_DIR"/*.jinja "$1"/ 2>/dev/null || true
fi
