from clusterrun.cli import main

main()
