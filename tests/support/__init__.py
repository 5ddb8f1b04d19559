"""What the tests share: the server launcher, problem assertions, op samples, objectives
and programs. No test module imports another test module
(tests/project/test_no_cross_imports.py)."""
