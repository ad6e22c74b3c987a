"""`specd train eagle`: an EAGLE head for a target model, from conversations to a head directory."""
