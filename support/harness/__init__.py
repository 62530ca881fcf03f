"""What runs the core: flags, a run's folder and life, checkpoints, evaluation, reports (the index is
support/__init__.py)."""
