"""What the core leans on: modules that import no core file and nothing of support/harness/ (the index is
support/__init__.py)."""
