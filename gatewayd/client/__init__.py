"""The command line for people (engineers, reviewers, auditors): the public API, from a terminal."""
