"""The `war` command line: argument parsing and rich tables over the library.

The CLI knows how to turn arguments into library calls and reports into tables; the
work itself (loading traces, replaying, speculating) lives in the packages it calls.
"""
