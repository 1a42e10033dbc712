"""The ``kvledger`` command line: one module per subcommand, argparse throughout."""
