from securevfl.cli import entry

entry()
