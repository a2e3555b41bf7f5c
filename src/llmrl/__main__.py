import sys

from llmrl.cli import main

sys.exit(main())
