"""
What runs the core: flags and checks, a run's folder and life, checkpoints, evaluation, reports (support/harness/).
It imports the core, and the core's entry points (train.py, evaluate.py) call it; a reader of the algorithm can
skip it. What the core itself leans on (kernels, caches, loaders, the scoring sandbox) is lib/, below the core,
which imports nothing of it. Importing a shelf does nothing.

harness/ (above the core)
  build.py           the Run every step reads, built around g: the policy and data, then LoRA and the optimiser
  checkpoint.py      save / load / --resume a run
  checks.py          the flags parsed and checked between themselves, the run before anything loads, its prompts
  config.py          every train.py flag in its group, its default and type, the presets; the one-line error
  export.py          the trained system at the end: LoRA as a PEFT adapter, g's weights
  folder.py          a run's folder: one writer (OUT/.lock), files written whole while Ctrl-C and SIGTERM wait,
                     a signal or a refused write ending the run in one line, within seconds even in a forward
  gold.py            the paired evaluation's greedy answers and gold-answer log-probs, one prefill
  metrics.py         what a step logs: its metrics.jsonl record and its terminal line
  model_check.py     what a model flag may name, checked before anything loads (one line, exit code 2)
  plan.py            --plan: the memory each device needs, on PyTorch's meta device
  plot.py            the plot train.py writes into a run's folder at the end; the figures over folders of runs
  report.py          the table and rho over folders of runs (evaluate.py --summarize)
  run.py             a run's life around the loop's steps: open, resume, log and save each step, finish
  track.py           --track: each step's record, live, to TensorBoard, Trackio or Weights & Biases
  validation.py      greedy validation of a live policy (--eval-items) and of a saved run

    python -c "from support.harness.checks import parse_args; print(parse_args(['--preset', 'smoke']))"
"""
