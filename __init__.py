"""pipeplan: a declarative compiler for pipeline-parallel and mixture-of-experts training."""

__version__ = "0.1.0"
