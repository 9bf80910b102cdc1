"""Exit-heads training, kept under the name the shipped exit heads record as their command:
the trainer is hf_selfspec/training/exit_heads.py (`hf-selfspec train-exit-heads`)."""

import sys

from hf_selfspec.training.exit_heads import main

if __name__ == "__main__":
    sys.exit(main())
