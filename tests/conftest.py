"""Test libraries shared by several test folders (``gguf_testlib``) import by name from here:
this folder goes on sys.path, whichever test file pytest starts from."""
import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
