import sys

from vibeqwen.cli import main

sys.exit(main())
