"""The test suite as a package: test modules and conftest files import their helpers as
`tests.helpers.<module>` (pytest puts the repository root on sys.path, since every test directory
is a package); nothing in tests/ edits sys.path."""
