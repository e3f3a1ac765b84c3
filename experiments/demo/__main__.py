from experiments.demo.pipeline import main

main()
