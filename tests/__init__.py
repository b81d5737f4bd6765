"""The test tree is one package (every folder has an `__init__.py`): shared helpers are imported by
their full name (`from tests.e2e.serve_pipeline import ServeProcess`), never through `sys.path`.
pytest's default `prepend` import mode puts the repository root first on `sys.path` for it, which also
makes `load_tests` (a namespace package) importable."""
