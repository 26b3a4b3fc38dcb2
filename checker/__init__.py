"""The checking role (issue 41): the user's checker judges finished records before they are filed."""
