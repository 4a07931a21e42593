import sys

from snapforensics.examples.scenarios.run import main

if __name__ == "__main__":
    sys.exit(main())
