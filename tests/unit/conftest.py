import sys
from pathlib import Path

# te_reference.py is a plain module beside the tests.
sys.path.insert(0, str(Path(__file__).parent))
