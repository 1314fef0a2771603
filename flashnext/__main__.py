from flashnext.tools.cli import main

main()
