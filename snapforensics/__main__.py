from snapforensics.cli import main

main()
