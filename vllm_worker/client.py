"""The documented import path `vllm_worker.client`: the same module as `vllm_worker.api.client`."""

import sys

from vllm_worker.api import client

sys.modules[__name__] = client
