from experiments.bench.gpu_check.runner import main

raise SystemExit(main())
