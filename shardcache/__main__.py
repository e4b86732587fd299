import sys

from shardcache.cli import main

sys.exit(main())
