"""What runs conversations for every command: the decisions reply, talk and serve share."""
