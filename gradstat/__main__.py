from gradstat.cli.app import main

main()
