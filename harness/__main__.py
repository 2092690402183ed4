import sys

from harness.present.cli import main

sys.exit(main())
