import sys

from harness.present.command import main

sys.exit(main())
