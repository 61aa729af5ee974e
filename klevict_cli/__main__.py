from klevict_cli.cli import main

main()
