# w4a8moe_case_tool: writes case files and compares `w4a8moe run` outputs across
# machines; the Arm stage runs the x86 build's copy next to the Arm program under qemu.
add_executable(w4a8moe_case_tool ${CMAKE_CURRENT_LIST_DIR}/case_tool.cpp)
target_compile_options(w4a8moe_case_tool PRIVATE ${W4A8MOE_WARNINGS})
target_link_libraries(w4a8moe_case_tool PRIVATE w4a8moe_io)
