import sys

try:
    from llmrl.cli import main
except KeyboardInterrupt:  # Ctrl-C while the command line itself is imported (main handles it from then on)
    print("\nllmrl: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
