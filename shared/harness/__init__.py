"""The measuring harness, the top layer: `runnerlab ab` and `runnerlab diff`, their workloads,
scenarios and reports, the Hugging Face reference, and the `runnerlab` command line."""
