"""mergestream: continual model merging — fold fine-tuned experts into a running backbone."""

__version__ = "0.1.0"
