import sys

from experiments.seeds.runner import main

sys.exit(main())
