"""An installable kernel-service plugin, as a third party would ship one (see the README's Kinds section)."""
