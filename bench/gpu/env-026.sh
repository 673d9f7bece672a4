# source me on the device before running vLLM 0.26 from /root/site
export PYTHONPATH=/root/site${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_USE_FLASHINFER_SAMPLER=0   # the default sampler would import flashinfer, which is not carried
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
