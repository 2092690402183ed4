import sys

from harness.rank.entry import main

sys.exit(main(sys.argv[1:]))
