"""Common English words for generated prompts. Each is one token (with its leading space) in
SmolLM2's tokenizer, and in most BPE vocabularies, so a prompt of N words is about N tokens; the
server's usage reports the exact count."""

_TEXT = """
    the of and to in is was for on that with as by at from it his an were are which this be
    has had or he not but have its first one new also after who they two her she been other
    when their all during into there time may more would about over can some year only than
    most them well many world later between three then city these both under states such
    through used state made where up part while being known out years number name same since
    each however people called began until before because including area family school second
    group based work early following several among national government war life last like
    small along much local home four any did even high use back long found series day season
    house what very place down five could way still against game became often around though
    law large members off within built public end little took set point music water region
    river man great body land side line form should system power center church important major
    team business country include women another period popular general without thus air rather
    order level play light old human right best across different common social change case
    party less upon above mother father company never held open young word north south east
    west red green blue black white gold silver stone wood tree forest garden road bridge lake
    sea ocean island mountain valley hill field farm village town market bread milk cheese
    apple orange lemon grape wine coffee tea sugar salt honey rice corn fish bird horse dog
    cat cow sheep goat lion bear wolf fox deer mouse snake frog bee ant spider book paper
    letter page story poem song dance art film picture color sound voice idea plan reason
    answer question problem fact truth history science nature money price cost value trade
    bank shop store office factory machine engine car train ship boat plane wheel door window
    wall floor roof room kitchen table chair bed lamp clock phone radio camera computer glass
    cup plate knife fork spoon bottle box bag coat shirt shoe hat ring chain rope key lock
    gate fence path street corner square circle edge top bottom front middle inside outside
    morning evening night summer winter spring autumn rain snow wind storm cloud sun moon star
    sky fire ice heat cold dark warm cool quick slow happy sad strong weak rich poor clean
    dirty quiet loud soft hard heavy simple easy difficult ready late short tall wide narrow
    deep full empty fresh dry wet sweet bitter bright calm brave proud gentle kind wise
    careful busy free safe sure true false real final minor private single double total
    central modern ancient foreign native natural normal special certain clear direct equal
    famous friendly similar serious basic whole close begin start finish stop move turn walk
    run jump swim fly drive ride carry bring send give take make build break cut hold keep
    leave lose find look watch listen hear speak talk tell ask call write read learn teach
    study think know believe remember forget understand feel love hate want need hope wish
    help try sing draw paint cook eat drink sleep wake live grow fall rise stand sit wait stay
    follow lead pay buy sell spend save count measure check test show hide share join meet
    visit travel return arrive reach pass cross enter climb push pull throw catch fill cover
    choose decide explain describe agree allow offer provide produce protect prepare promise
    report serve support
"""

WORDS: tuple[str, ...] = tuple(_TEXT.split())
