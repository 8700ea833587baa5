"""bench/swarm: an emulated cluster (netns + veth + tc) comparing bdn, boto3 and libtorrent."""
