"""Fixed sizes of the sampling inputs and outputs every program has (program contract version 3).

Shared by ``ignition`` (which shapes the programs) and ``helios`` (which fills
their inputs and reads their outputs); nothing here imports torch.
"""

from __future__ import annotations

TOP_LOGPROBS = 20  # alternatives per output position a program reports (OpenAI's and vLLM's maximum)
LOGIT_BIAS_ENTRIES = 300  # logit_bias entries a request may send (OpenAI's limit)
SUPPRESSED_ENTRIES = 20  # further bias rows for min_tokens: end-of-sequence and stop_token_ids ids
BIAS_CAPACITY = LOGIT_BIAS_ENTRIES + SUPPRESSED_ENTRIES  # the bias_* inputs' second dimension
BIAS_FOREVER = 2**31 - 1  # bias_until of an entry that applies at every position (int32 max)
