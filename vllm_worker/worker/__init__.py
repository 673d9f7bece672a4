"""The GPU worker: vLLM mixes `extension.LensWorkerExtension` into every worker (its RPC surface); the
runtime on each model runner plans every step, runs the taps inside the forward pass and keeps results
until the frontend fetches them."""
