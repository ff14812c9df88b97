"""Published Gemma 3 configs the tests read (kept in `tests/real_size_configs.py`)."""

from tests.real_size_configs import GEMMA3_27B_TEXT

__all__ = ["GEMMA3_27B_TEXT"]
