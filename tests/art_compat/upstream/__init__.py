"""Real programs taken from ART's repositories, each changed only where its header says (imports,
base model name, a local data file); `run_program` (test_upstream_programs.py) runs them."""
