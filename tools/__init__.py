"""Scripts beside the package, grouped by job; each runs as a file (``python tools/<group>/<script>.py``) and
imports the others by their package names (``tools.fixtures.make_fixtures``). docs/architecture.md, "tools/",
lists the groups."""
