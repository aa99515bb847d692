"""The embedded model's routing: the trace corpus and the routing report in docs/tiny-model.md."""
